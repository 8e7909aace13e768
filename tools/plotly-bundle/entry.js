// The traces driftcheck's HTML report draws: scatter (the drift chart, the long-run curves) and
// heatmap (the module map). plotly.js's own partial-bundle entry points, as its lib/index-*.js.
'use strict';

var Plotly = require('plotly.js/lib/core');

Plotly.register([
    require('plotly.js/lib/scatter'),
    require('plotly.js/lib/heatmap'),
]);

module.exports = Plotly;

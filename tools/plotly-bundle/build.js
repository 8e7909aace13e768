// Builds ../../driftcheck/vendor/plotly-driftcheck.min.js (plotly.js core + scatter + heatmap,
// minified) and copies plotly.js's LICENSE beside it. Run: npm ci && node build.js
//
// The settings are plotly.js's own (esbuild-config.js: iife, global Plotly, stream aliased,
// global -> window, NODE_DEBUG off, target es2016) with the attribute compression its dist
// bundles get (tasks/compress_attributes.js: the schema's `description`, `hrName`,
// `requiredOpts`, `otherOpts` removed; they only document the attributes). Its plugins for
// WebGL shaders and maplibre's CSS are left out: neither trace uses them (the CSS import in
// src/registry.js is loaded as empty).
'use strict';

const fs = require('fs');
const path = require('path');
const esbuild = require('esbuild');

const root = path.resolve(__dirname, '..', '..');
const out = path.join(root, 'driftcheck', 'vendor');
const version = require('plotly.js/package.json').version;

// One quoted string (no line breaks), a list of them (comments allowed), a property ending a
// line: what is removed must be a whole `key: value` and nothing after it.
const STR = String.raw`(?:'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")`;
const LIST = String.raw`\[(?:\s*(?:${STR}\s*(?:\+\s*${STR}\s*)*,?|\/\/[^\n]*))*\s*\]`;
const END = String.raw`\s*,?(?=[ \t]*(?:\n|\}|\/\/))`;
const STRIP = [
    new RegExp(String.raw`\b(?:description|hrName): ${STR}(?:\s*\+\s*${STR})*${END}`, 'g'),
    new RegExp(String.raw`\bdescription: ${LIST}\.join\(\s*${STR}\s*\)${END}`, 'g'),
    new RegExp(String.raw`\b(?:requiredOpts|otherOpts): ${LIST}${END}`, 'g'),
];

const compressAttributes = {
    name: 'compress-attributes',
    setup(build) {
        build.onLoad({ filter: /plotly\.js[\\/]src[\\/].*\.js$/ }, async (args) => {
            let text = await fs.promises.readFile(args.path, 'utf8');
            for (const re of STRIP) text = text.replace(re, '');
            return { contents: text, loader: 'js' };
        });
    },
};

const banner = `/*! plotly.js v${version} partial bundle (core, scatter, heatmap) for driftcheck's HTML report.
 * Copyright Plotly, Inc. MIT license: plotly.js-LICENSE.txt beside this file.
 * Built by tools/plotly-bundle/build.js with esbuild ${require('esbuild/package.json').version}. */`;

esbuild.build({
    entryPoints: [path.join(__dirname, 'entry.js')],
    outfile: path.join(out, 'plotly-driftcheck.min.js'),
    format: 'iife',
    globalName: 'Plotly',
    bundle: true,
    minify: true,
    sourcemap: false,
    legalComments: 'eof',
    banner: { js: banner },
    loader: { '.css': 'empty' },
    plugins: [compressAttributes],
    alias: { stream: 'stream-browserify' },
    define: { global: 'window', 'define.amd': 'false', 'process.env.NODE_DEBUG': 'false' },
    target: 'es2016',
    logLevel: 'info',
}).then(() => {
    fs.copyFileSync(require.resolve('plotly.js/LICENSE'), path.join(out, 'plotly.js-LICENSE.txt'));
}).catch(() => process.exit(1));

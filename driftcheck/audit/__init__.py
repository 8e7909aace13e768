"""Semantic audits: BatchNorm running statistics (``batchnorm``) and view/in-place ops (``views``).

Both produce ``driftcheck.report.Finding`` objects; neither needs the reference run to be
numerically close, only to be semantically correct.
"""

"""driftcheck where training code already lives (each integration is an optional extra).

    session.py        TraceSession: a traced run driven by another loop's hooks (shared below)
    transformers.py   DriftcheckCallback for a Hugging Face Trainer (pip install transformers accelerate)
    lightning.py      DriftcheckCallback for a Lightning Trainer (pip install lightning)
    pytest_plugin.py  the driftcheck_gate fixture and --driftcheck-* options (entry point pytest11)

Nothing here is imported by ``import driftcheck``; each module imports its framework itself and
says in one line what to install when it is missing.
"""

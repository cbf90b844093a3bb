"""Development, build and test tooling; no image ships it.

It builds the loopback Kubernetes control plane and the vLLM comparison
environment, fetches the real demo model pair, makes the tiny in-code models,
runs the demo (`make run`) and the GPU check, generates docs/api.md and the
chart's CRDs, and drives the kind end-to-end run. The CPU image's build stage
runs make_demo_models.py; its final stage keeps only the models it wrote. Run a
module as ``python -m tools.<name>`` from the repo root.
"""

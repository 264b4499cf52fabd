"""Code generated from protos/ by `python -m generated`; do not edit by hand."""

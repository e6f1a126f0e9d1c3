"""Checkpoint conversion (AR / LLaDA / Dream / Megatron <-> hf-dlm), asserted verification and Hub export.

Nothing here is imported by `import hf_dlm`; the modules load when a conversion runs.
"""

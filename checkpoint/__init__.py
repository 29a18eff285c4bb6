"""Checkpoints and the run folder: when a run saves and how it resumes (checkpointer.py), the sharded
training state on disk (sharded.py), arcface_torch's checkpoints (arcface.py), earlier pairface
versions' checkpoint.pt (legacy.py), the run folder and its lock (run_dir.py)."""

"""Checkpoints and the run folder: when a run saves and how it resumes (checkpointer.py), the sharded
training state on disk (sharded.py), what a run can start from, one importer per kind (sources.py:
its own checkpoints, arcface_torch's (arcface.py), earlier versions' checkpoint.pt, a bare backbone),
the run folder and its lock (run_dir.py)."""

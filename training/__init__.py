"""What a training step changes and how one step runs, shared by train.py, the checkpoint converter,
the benchmarks and the tests: the training state (state.py), the step (step.py) and the memory plan
of a configuration (memory_plan.py)."""

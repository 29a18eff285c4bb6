"""Developer tooling that is not a test: `make mutants` (mutants.py), `make test-flaky` (flaky.py) and the
import-linter contract type that `lint-imports` checks the layers with (layers_contract.py)."""

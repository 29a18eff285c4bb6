"""The GPU acceptance harness: what only a GPU can show, checked within one lease (gpu_check.sh)."""

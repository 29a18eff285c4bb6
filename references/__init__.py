"""Upstream's algorithms as written, loop for loop: what tests check pairface against and benches time it
against. Independent of pairface's own code (numpy and sklearn only)."""

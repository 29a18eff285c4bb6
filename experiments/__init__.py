"""Learning experiments: does pairface learn, measured by training real runs (`python -m experiments.<name>`)."""

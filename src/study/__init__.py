"""The study wing: cells of a sweep (names, identities, labels), their fresh-evaluation budget, and SLURM plans."""

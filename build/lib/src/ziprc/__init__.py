"""ZIP-RC-Lite (seed 004 sections 3.2, 4.2, 5.2): a reserved-logit reward/length head and adaptive decoding."""

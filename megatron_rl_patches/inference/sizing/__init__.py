"""Memory formulas from a model's size alone, torch-free (the `memory` CLI): `memory` (the
training state a trainable build holds beyond the weights) and `residency_plan` (device and host
weight bytes per residency mode)."""

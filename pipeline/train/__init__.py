"""Stage 2: data loader, backend, trainer loop, checkpoints."""

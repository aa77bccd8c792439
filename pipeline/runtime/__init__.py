"""Process-level pieces every stage shares: exit statuses, folder locks, seeds, output folders (torch-free)."""

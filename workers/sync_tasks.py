"""Weight-sync tasks (group bootstrap, engine join, group destroy)."""

"""What every job shares: command-line checks, outputs written together, reports, statistics, progress, names."""

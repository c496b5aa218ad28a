"""Level 1 and the mixture: schedules, selectors, the mixing loops, the Mixture and its Reader, elastic resume."""

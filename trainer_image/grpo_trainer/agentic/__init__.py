"""Tool calls and environments (`training.tools`, `environmentFactory`): the user's tools and environment
factories loaded and guarded, and the episodes they make (multi-row groups, their counts)."""

"""The recipe language: the recipe file, its policy and guards, targets, and the JSON schema."""

"""The plan (what a deployment runs) and the passes that change it, with the small choices they share."""

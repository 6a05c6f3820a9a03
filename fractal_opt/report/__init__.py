"""What a user reads: the run's record (trace.py), its one reader (reader.py) and every rendering of it.

The first screen answers the recipe's question (first_screen.py); the terminal summary
(terminal.py), report.md (markdown.py), report.html (html.py and its sections) and a notebook's
view draw the same reader, so every final figure has one source: the final confirmation.
"""

"""The vocabulary every room speaks: errors, text formatting, safe file reading and validation, the machine."""

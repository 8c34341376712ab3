"""``hsx check``: everything that can be checked before a long job starts."""

"""Serving: engine slots shared by streams that come and go, the loop that drives them, and its load benchmark."""

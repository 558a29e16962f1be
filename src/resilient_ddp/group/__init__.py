"""The process group's life: start-up checks (preflight), init and destroy, and regrouping
into a new generation after a failure (membership)."""

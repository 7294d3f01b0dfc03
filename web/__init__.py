"""The htmx dashboard (DESIGN §7). Not built yet (issue 9)."""

"""The browser page served at ``/`` (plain HTML and JavaScript, no build step)."""

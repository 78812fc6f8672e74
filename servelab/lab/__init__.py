"""The lab: interactive lessons on inference economics, served as a single-page web app.

Every number on a chart comes from the JSON API in `servelab.lab.api`, which calls the real
roofline (`servelab.cost`) and simulator (`servelab.sim`); the page only draws them.
"""

from servelab.lab.app import create_lab_app

__all__ = ["create_lab_app"]

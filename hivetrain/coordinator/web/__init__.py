"""The coordinator dashboard's parts: snapshot types, the SVG chart, and the Jinja2 templates (``templates/``)."""

"""Dashboard pages, one view each; Dash imports them by path (see app.create_app)."""

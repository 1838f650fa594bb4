"""The web app's pieces. `edits` (what one widget change fixes in the others, where an error goes, the sidebar's
groups, the first view) is pure; `cache`, `results` and `simulate` draw with streamlit and are imported by app.py
only."""

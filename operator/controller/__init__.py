"""The Kopf controller: handlers, reconciliation, rendering and applying children."""

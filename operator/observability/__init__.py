"""The operator's own metrics, the PromQL, dashboards and alert rules built from it."""

"""The API gateway: HTTP and the dashboard over the state the services publish."""

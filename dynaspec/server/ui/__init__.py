"""The built-in web page (`/ui`): a chat playground and a live speculation dashboard, fed by
`/ui/live` (the /metrics counters as JSON). `dynaspec serve --no-ui` leaves it out."""

"""Cross-run studies: `grt sweep` (a folder of recipes through `grt run`), `grt compare`, `grt fit-phi` and
`grt paper-table`, from what `grt eval` saved."""

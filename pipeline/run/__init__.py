"""`grt run`: one recipe end to end (tokenize -> train -> eval); `grt sweep` (pipeline/studies/) runs it for every
recipe of a folder."""

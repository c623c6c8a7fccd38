"""Configuration: one frozen dataclass per role (`roles`), filled from defaults, a YAML file and
command-line flags, in that order of precedence (`sources`)."""

"""Built-in scheduling profiles (YAML)."""

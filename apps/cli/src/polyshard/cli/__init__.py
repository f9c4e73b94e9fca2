"""polyshard.cli: the `polyshard` command."""

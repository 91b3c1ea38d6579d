"""Plans computed from the config alone, before any process starts: memory per rank (``memory``,
checked by the launcher through ``fit``) and the search over parallel layouts (``layouts``)."""

"""What plugin authors build on: the few-line function adapter, the mask builder, ready-made divergences."""

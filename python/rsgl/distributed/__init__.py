"""Tensor parallelism's bottom layer: which slice of a model each rank holds (`sharding`) and
the group its ranks reduce and gather over (`group`). Models and layers import it; it imports
none of them."""

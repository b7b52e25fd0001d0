"""A torchvision built for another torch, for the tests: PYTHONPATH names the folder above, and
importing torchvision then fails as such a build does (one installed from another package index
than torch's)."""

raise RuntimeError("operator torchvision::nms does not exist")

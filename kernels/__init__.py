"""Triton kernels for the model's hot ops, each beside its plain-torch reference `<op>_ref`.
The package owns how an op is computed on a device, not what it computes (the references and
`dsv4` define that) nor whether it runs (`kernels.select`, built from the entry point's
settings); it never imports `services/`, and the torch backend never imports triton."""

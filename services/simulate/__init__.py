"""`dspark simulate`: a discrete-event serving simulator in virtual time (docs/simulate.md).

`models` holds the step-time models and their sources, `roofline` the `gpu` shape, `engine`
the event loop over the services' own policy objects, `run` the arms, loads and figures,
`cli` the command.
"""

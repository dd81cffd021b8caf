"""The gpufed command line (`cli`, with `jobcommands`, `fleetcommands`, `problems`,
`completions`, `client`, `logs`, `tables`), on top of `gpufed.sim` (the
trace simulator) and `gpufed.local` (broker and agents as local processes, and the demo)."""

"""The gpufed command line: services (broker, agent), user commands, demo and simulator."""

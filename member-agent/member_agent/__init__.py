"""gpufed member agent: one per cluster; places, binds and reports GPU jobs."""

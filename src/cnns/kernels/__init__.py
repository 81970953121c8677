"""Hand-written CPU passes that no library has (see norm_act.cpp), built when the package is installed."""

"""servescope.analysis"""

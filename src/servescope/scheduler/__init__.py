"""servescope.scheduler"""
